"""Operations: reading histories offline (describe, timeline, replay, inspect),
the status table and the Prometheus exporter. None of it imports the worker.
"""
