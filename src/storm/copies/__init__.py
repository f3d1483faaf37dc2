"""The copies between a saved tensor's memory and the store's pool: one handler per medium pair
(base.py: the interface and the one completion type, ``Copy``). storm/mover.py routes to them."""
