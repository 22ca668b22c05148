"""The web console (issue 17; docs/web.md): see the pipeline and repair it from a browser.

Server-rendered pages (aiohttp, Jinja2) with a little JavaScript for live
refresh; repairs go through `pepsi.admin.queue_repair`, the code `pepsi queue` runs.
"""
