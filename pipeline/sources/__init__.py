"""Where inputs come from: Neuronpedia's API (api, fetch), its bulk exports (exports), the fetch
manifests (manifest), the nightly plan read from featurehouse.toml (plan) and a drop folder
(inbox). Each source hands what it got to the orchestrator, ``pipeline.ingest``.
"""
