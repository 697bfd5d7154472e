"""Devices and processes: the mesh and every array's sharding, what differs between one process
and several, and whether this machine is the hardware a config was written for.
"""
