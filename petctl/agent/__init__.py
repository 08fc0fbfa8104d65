"""The elastic agent every instance runs (`petctl-agent`): never imports torch; see agent.py."""
