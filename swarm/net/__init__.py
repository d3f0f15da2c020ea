"""What every process shares: protocol, wire, lanes, transport, compression, security, records, addresses, network,
errors, the view of the swarm and the RPC servicer. Imports nothing of the client, the peers, ops or the harness."""
