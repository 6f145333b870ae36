"""Engines and their workers: the scheduler, the supervisor, the worker loop, and their messages."""
