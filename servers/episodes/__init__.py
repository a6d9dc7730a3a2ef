"""Episodes, leases and the ledger: the pool of leases a server hands out (`rollout_pool`, `leases`), `end` in one
step (`recorder`), this server's half of a two-phase commit (`prepared`, `overdue`), `Sample`s and the SQLite ledger
(`samples`, `ledger`), and `marl episode` (`view`)."""
