"""A headless Chromium drives the web console against a live dispatcher."""
