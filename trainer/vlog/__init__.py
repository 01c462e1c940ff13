"""Verifier log v1 (docs/verifier_log.md): what the target saw at every verification step, written by servers
and ``trainer eval --logs``, read by the adaptation daemons. ``schema`` validates records, ``writer`` appends
them to rotating segments off the decoding thread, ``reader`` tails a directory of segments and decodes batches
of step lines into arrays (``workers`` runs that decoding in worker processes)."""
