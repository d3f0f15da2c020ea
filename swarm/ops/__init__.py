"""Operations: the command line, `swarm status`, the health state and the monitor page."""
