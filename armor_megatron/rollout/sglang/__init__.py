"""SGLang 0.5.x engines over HTTP: client, launcher, weight sync, engine.

Nothing here imports SGLang at import time; servers run as separate processes
(``python -m sglang.launch_server``) and are reached over HTTP.
"""
