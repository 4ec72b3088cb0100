"""What callers use to reach a pool: the `AgentRoster` facade, its transport,
the router, invoking agents, lease tokens and the settings read from the environment.
It does not import the worker, the agent runtime or the operations tools.
"""
