"""The training loop and what it moves: engine states, boot and weight publishing (`lifecycle`), full batch -> drain
-> train -> publish -> checkpoint (`loop`, woken by `batch_wakeup`), and checkpoint directories (`checkpoint_dirs`)."""
