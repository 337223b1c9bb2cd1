"""What starts and drives vLLM engines, for the bench, the tests and `kvprefetch serve` alike.

An engine process (`engine_proc`) spoken to in one protocol (`protocol`) through a client (`client`), forked from
a zygote that imported vLLM once (`zygote`); its probes and load drivers (`probes`, `sessions`, `agent_client`,
`pressure`); vLLM's OpenAI server started and driven over HTTP (`server`, `local_servers`); where engines run on a
CPU machine standing in for a GPU node (`topology`); several nodes in network namespaces joined by shaped links
(`netns`, `cluster`). The testbed imports nothing of `kvprefetch.bench`: the bench is built on it, as the tests are.
"""
