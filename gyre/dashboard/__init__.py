"""`gyre dashboard`: a read-only web page over the execution log.

- views.py: pure, events → what the page shows (plotly figures as JSON, tables as rows);
- source.py: the read model, folding each run's events from the store (or an exported log) as they arrive;
- app.py: the FastAPI app serving the page, its JSON and the bundled plotly.js; a token beyond localhost;
- static/: the page itself (HTML, a small script, styles).
"""
