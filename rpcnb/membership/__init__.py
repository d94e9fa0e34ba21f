"""A group's life as its members see it: becoming a member (``start``), leaving
(``leave``), a member's failure (``failures``), restarting and adding workers (``resize``),
what other members may ask of this one (``handlers``) and the table ``%rpc_workers``
prints (``view``).
"""
