"""The agent runtime: register, heartbeat, serve tasks over HTTP, drain.
It runs beside the client and never imports the worker.
"""
