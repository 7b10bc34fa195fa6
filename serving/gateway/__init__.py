"""The gateway: an OpenAI-compatible front door that routes traffic between snapshots.

Champion, canary (a sticky weighted share of conversations) and shadow (mirrored, answers compared and
discarded) are each a pool of replica URLs: our engine servers or any OpenAI-compatible server. It runs
in its own process and never imports torch. See ``app.py`` for the routes and ``proxy.py`` for the data path.
"""
