"""``python -m pipeline.cli``: the ``featurehouse`` command, as the entry point runs it."""

from . import main

main()
