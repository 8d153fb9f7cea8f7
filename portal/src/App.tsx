import { LocationProvider, Route, Router, useLocation } from "preact-iso";
import { useEffect, useState } from "preact/hooks";
import { currentSession, signOut, whenSignedOut, type Session } from "./api";
import { Billing } from "./pages/Billing";
import { BudgetPage } from "./pages/Budget";
import { Chaos, ChaosExperimentPage } from "./pages/Chaos";
import { Dashboard } from "./pages/Dashboard";
import { Endpoints } from "./pages/Endpoints";
import { Fleet } from "./pages/Fleet";
import { Health } from "./pages/Health";
import { Lifecycle } from "./pages/Lifecycle";
import { Keys } from "./pages/Keys";
import { Prices } from "./pages/Prices";
import { SignIn } from "./pages/SignIn";
import { Secrets } from "./pages/Secrets";
import { Volumes } from "./pages/Volumes";
import { SshKeys } from "./pages/SshKeys";
import { Submit } from "./pages/Submit";
import { TenantPage, Tenants } from "./pages/Tenants";
import { WorkloadPage } from "./pages/Workload";

export function App() {
  const [session, setSession] = useState<Session | null | undefined>(undefined);
  const [notice, setNotice] = useState("");
  useEffect(() => {
    whenSignedOut((why) => {
      setNotice(why);
      setSession(null);
    });
    currentSession()
      .then(setSession)
      .catch(() => setSession(null));
  }, []);
  if (session === undefined) return <p class="loading">Loading…</p>;
  if (session === null)
    return (
      <SignIn
        notice={notice}
        onSignedIn={(s) => {
          setNotice("");
          setSession(s);
        }}
      />
    );
  return (
    <LocationProvider scope="/portal">
      <Shell session={session} onSignedOut={() => setSession(null)} />
    </LocationProvider>
  );
}

function Shell({ session, onSignedOut }: { session: Session; onSignedOut: () => void }) {
  const { url, route } = useLocation();
  useEffect(() => {
    if (url === "/portal" || url === "/portal/") route(session.operator ? "/portal/fleet" : "/portal/dashboard", true);
  }, [url]);
  const links = session.operator
    ? [
        ["/portal/fleet", "Fleet"],
        ["/portal/tenants", "Tenants"],
        ["/portal/prices", "Prices"],
        ["/portal/health", "Health"],
        ["/portal/lifecycle", "Lifecycle"],
        ["/portal/chaos", "Chaos"],
      ]
    : [
        ["/portal/dashboard", "Dashboard"],
        ["/portal/submit", "Submit"],
        ["/portal/billing", "Billing"],
        ["/portal/budget", "Budget"],
        ["/portal/keys", "API keys"],
        ["/portal/ssh-keys", "SSH keys"],
        ["/portal/secrets", "Secrets"],
        ["/portal/volumes", "Volumes"],
        ["/portal/endpoints", "Endpoints"],
      ];
  return (
    <>
      <a class="skip" href="#main">
        Skip to content
      </a>
      <header>
        <strong class="brand">Rackplane</strong>
        <nav aria-label="Main">
          {links.map(([href, text]) => (
            <a href={href} aria-current={url.startsWith(href) ? "page" : undefined}>
              {text}
            </a>
          ))}
        </nav>
        <span class="who">
          {session.operator ? "Operator" : "Tenant"} · key rp_{session.key_prefix}…
        </span>
        <button
          type="button"
          onClick={async () => {
            await signOut().catch(() => {});
            onSignedOut();
          }}
        >
          Sign out
        </button>
      </header>
      <main id="main" tabIndex={-1}>
        <Router>
          <Route path="/portal/dashboard" component={Dashboard} />
          <Route path="/portal/submit" component={Submit} />
          <Route path="/portal/workloads/:id" component={WorkloadPage} />
          <Route path="/portal/billing/:period?" component={Billing} />
          <Route path="/portal/budget" component={BudgetPage} />
          <Route path="/portal/keys" component={Keys} session={session} />
          <Route path="/portal/ssh-keys" component={SshKeys} session={session} />
          <Route path="/portal/secrets" component={Secrets} session={session} />
          <Route path="/portal/volumes" component={Volumes} session={session} />
          <Route path="/portal/endpoints" component={Endpoints} session={session} />
          <Route path="/portal/fleet" component={Fleet} />
          <Route path="/portal/tenants" component={Tenants} />
          <Route path="/portal/tenants/:id" component={TenantPage} />
          <Route path="/portal/prices" component={Prices} />
          <Route path="/portal/health" component={Health} />
          <Route path="/portal/lifecycle" component={Lifecycle} />
          <Route path="/portal/chaos" component={Chaos} />
          <Route path="/portal/chaos/:id" component={ChaosExperimentPage} />
          <Route default component={NotFound} />
        </Router>
      </main>
    </>
  );
}

function NotFound() {
  return <p>Nothing here. Pick a page above.</p>;
}
