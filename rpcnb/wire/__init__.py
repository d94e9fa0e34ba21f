"""What crosses the wire, below any group: the one module that touches private torch
(``_torch``), a group's settings and backend options (``options``), device maps
(``devicemap``) and notebook code as a module of every process (``notebook``).
"""
