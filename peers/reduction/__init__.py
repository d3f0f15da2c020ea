"""A peer's side of a step's reduction, in one place: the gradients it holds and hands on (``held``), the partial sums
and reduced gradient a block keeps (``sums``), the direct exchange and what the service calls (``exchange``), the
audits of what other holders send (``audit``) and the reduction in chunks (``scatter``). The wire's pure sums, which
the client checks too, stay in swarm/net/reduction.py. ARCHITECTURE.md "One reduction per step"."""
