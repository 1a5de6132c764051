"""[core] hostname_callable for the Celery test: two workers on one machine record distinct
task-instance hostnames (FEATUREHOUSE_TEST_WORKER, set per worker); in containers each worker
has its own hostname and this is not used."""

import os
import socket


def get() -> str:
    return os.environ.get("FEATUREHOUSE_TEST_WORKER") or socket.getfqdn()
