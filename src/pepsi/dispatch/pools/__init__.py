"""Every stage's elastic pool of worker processes, and each worker as the dispatcher sees it."""
