"""The rollout server (`trl-cb serve`), its HTTP protocol, weight sync and the trainer-side client (docs/server.md).

Importing this package needs the `serve` extra (fastapi, uvicorn, requests) only for the modules that use them.
"""
