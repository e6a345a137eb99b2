"""Two "hosts" on one machine, for the bench and the tests only: network and PID namespaces
(netns.py), PD across them started with the per-host commands (two_host.py), and a TCP relay from
the root namespace into one of them (netns_relay.py). Nothing the product runs imports this package."""
