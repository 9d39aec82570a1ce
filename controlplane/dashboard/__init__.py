"""The web dashboard: page shells, static assets (plotly.js from the installed package) and the
account-scoped JSON the pages read."""
