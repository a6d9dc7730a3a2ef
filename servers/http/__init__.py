"""The HTTP surface of a swarm server: routes and authentication (`routes`), what runs before FastAPI (`guards`:
credentials, body limits, JSON 500s) and the OpenAPI document (`openapi`). Each route is one call into the server."""
