"""Registered DRAM buffer pools: the PE buffer and the DE buffer, with reservations."""
