"""The node agent: hardware discovery, memory registration and the node's store tier."""
