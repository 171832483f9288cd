"""Serving: the scheduler, preemption and the continuous-batching engine (lessons 04, 06, 08, 09)."""
