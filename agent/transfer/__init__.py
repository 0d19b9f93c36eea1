"""The transfer engine: batch READ/WRITE between registered segments over shm, tcp, rdma and link."""
