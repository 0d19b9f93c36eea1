"""Node topology from sysfs: PCI devices, NICs, link classes, NIC ranking and GDR decisions."""
