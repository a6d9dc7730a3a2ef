"""The game transaction across servers: the coordinator plays one game (coordinator.py), committing each
server's episode all or nothing (two_phase.py) with its decisions logged (decision_log.py)."""
