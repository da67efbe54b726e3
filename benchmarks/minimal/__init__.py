"""The minimal project that the library is measured in (``benchmarks/minimal.py``).

One ``Payment`` model, a ``ModelViewSet`` whose create is one insert, HTTP Basic authentication
with a fast hasher, persistent connections, psycopg 3 or mysqlclient: what a user's API is at its
smallest, so that what the library adds is not hidden under a larger project's own costs. Each
idempotent view stands beside a bare copy of itself and a naive floor done by hand (``naive.py``).
"""
