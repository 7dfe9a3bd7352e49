"""The client side of rollout servers: `RemoteRollout` generates on running `zerokl serve` servers and syncs weights
into them (`remote`); `LocalServers` starts N servers on this machine for one run and stops them with it
(`local_servers`); `http` is one server as the client sees it.
"""
