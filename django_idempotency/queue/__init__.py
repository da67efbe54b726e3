"""The durable retry queue that the inbox's processing and the outbox's relay share: claiming due
rows, backoff with jitter, dead-lettering and error texts. Each keeps only what is its own
(handlers; dispatchers).
"""
