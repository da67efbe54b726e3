"""The durable retry queue that the inbox's processing and the outbox's relay share: the claim
(``SELECT … FOR UPDATE SKIP LOCKED``), the count of attempts, backoff with jitter, dead letters,
error texts, and the worker's loop. Each keeps only what is its own (handlers; dispatchers).
"""
