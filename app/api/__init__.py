"""The REST interface: one router module per domain, each calling its domain's services (the
same functions GraphQL's resolvers call). `app.main` mounts them."""
