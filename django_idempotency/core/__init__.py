"""The private core: the engine that makes an operation idempotent by key, the key store and its
SQL, and what the adapters, the inbox and the outbox share (canonical hashing, deferred counts,
batched purges, optional imports). Nothing here is imported by users: the public entry points
are the modules beside this folder.
"""
