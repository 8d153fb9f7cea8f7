"""The portal's GraphQL API: one Strawberry schema over the same services as REST."""
