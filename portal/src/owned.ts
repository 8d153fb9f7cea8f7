import { useEffect, useState } from "preact/hooks";
import { asProblem, gql, isProblem, type Problem } from "./api";

// What the pages of a tenant's own named objects share (SSH keys, secrets, volumes): their
// list, a page at a time, and deleting one with its refusal shown on its row.

interface Connection<T> {
  edges: { node: T }[];
  pageInfo: { hasNextPage: boolean; endCursor: string | null };
}

/** The connection `field` of `query` (which takes `$after`), with "show more". */
export function useOwnedList<T>(query: string, field: string) {
  const [items, setItems] = useState<T[] | null>(null);
  const [next, setNext] = useState<string | null>(null);
  const [error, setError] = useState("");
  const load = async (after: string | null = null) => {
    try {
      const d = await gql<Record<string, Connection<T>>>(query, { after });
      const got = d[field].edges.map((e) => e.node);
      setItems((old) => (after && old ? [...old, ...got] : got));
      setNext(d[field].pageInfo.hasNextPage ? d[field].pageInfo.endCursor : null);
      setError("");
    } catch (e) {
      const p = asProblem(e);
      setError(`${p.message} (${p.code})`);
    }
  };
  useEffect(() => {
    load();
  }, []);
  return { items, next, error, load };
}

/** Delete one row through the mutation `field` of `mutation`: the list again when done, the
 * refusal's words on the row (by its `key`) when not. */
export function useRowDelete(mutation: string, field: string, reload: () => void) {
  const [rowProblem, setRowProblem] = useState<{ key: string; text: string } | null>(null);
  const remove = async (key: string, variables: Record<string, unknown>) => {
    setRowProblem(null);
    try {
      const d = await gql<Record<string, { __typename: string } | Problem>>(mutation, variables);
      const r = d[field];
      if (isProblem(r)) setRowProblem({ key, text: `${r.message} (${r.code})` });
      else reload();
    } catch (e) {
      const p = asProblem(e);
      setRowProblem({ key, text: `${p.message} (${p.code})` });
    }
  };
  return { rowProblem, remove };
}
