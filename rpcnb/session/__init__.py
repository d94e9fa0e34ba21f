"""This process's session in a group: its record (``state``), where the group meets and
who may enter (``rendezvous``), who is in it (``roster``) and how members ask each other
(``protocol``).
"""
