"""The serving path: the simulated engine, the PD router and the load generator, and the contract they share."""
