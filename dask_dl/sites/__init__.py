"""Training across sites without moving patient data: protocols that move only weights between hospitals.

One cluster per site (a client per site, only weights travel) or one shared cluster whose workers belong to sites
(a guard keeps every site's data on its own workers and audits what moved).
"""
