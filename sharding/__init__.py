"""Meshes, logical-axis rules and placement for tensor/expert parallelism; multi-host setup."""

from xlaserve.sharding.mesh import Placement, make_mesh

__all__ = ["Placement", "make_mesh"]
