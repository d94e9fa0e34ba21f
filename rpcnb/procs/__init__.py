"""How member processes come to exist: the kernel's side of the warm launcher (``launch``)
and the launcher's process that forks workers (``forkserver``).
"""
