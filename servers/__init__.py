"""The swarm server: one process per model (`marl serve`). Rooms by concern (docs/architecture.md): `http/`,
`calls/`, `episodes/`, `training/`, `policies/`, `metrics/`, `engines/`, `trainers/`; `backends.py` holds the two
seams an engine and a trainer implement. Old module paths (before the rooms) still import, with a warning, for one
release: `marl.moved`."""

from marl.moved import install as _install_moved_modules

_install_moved_modules()
