"""Node topology from sysfs: PCI devices, NICs, link classes, NIC ranking and GDR decisions."""

from daybreak.agent.topology.discover import DEFAULT_SUNRISE_VENDORS, build, discover, parse_vendor_ids
from daybreak.agent.topology.model import LEGEND, Pair, TopoDevice, Topology

__all__ = ["DEFAULT_SUNRISE_VENDORS", "LEGEND", "Pair", "TopoDevice", "Topology", "build", "discover",
           "parse_vendor_ids"]
