"""Other engines' processes as members of a group: ipyparallel's engines (local, MPI, SSH,
Slurm, PBS, LSF).
"""
