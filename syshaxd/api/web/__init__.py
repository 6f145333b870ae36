"""The web page: its route (routes) and its four static files beside it."""
