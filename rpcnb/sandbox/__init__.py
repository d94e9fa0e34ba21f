"""Isolation from the machine's other users: the private network namespace (``netns``),
whether this process is in it (``isolation``), and the kernel provisioner
(``provisioner``).
"""
