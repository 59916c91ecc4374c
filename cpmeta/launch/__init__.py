"""launch: ``python -m cpmeta.launch`` spawns a CP group; ``launch.worker`` is the per-rank step loop."""
