"""The leader's domain services: what the controllers call.

Each owns one part of what an operator (or a joining host) can ask, and gets what it depends
on in its constructor (:func:`silentswarm.leader.app.create_app` builds them in order):

- :class:`~leader.services.jobs.JobsService`: submit, read, cancel and checkpoint jobs, their
  metrics, history and stream, and shard downloads;
- :class:`~leader.services.fleet.FleetService`: fellows, hosts, the cluster view, release,
  update, pending purges and their retry, fellows' logs;
- :class:`~leader.services.onboarding.OnboardingService`: the bootstrap manifest, join
  sessions, enrollment, the names they settle;
- :class:`~leader.services.info.InfoService`: the leader's info and health.

Where an action needs the job loop's machinery (its signal hub, a save, a wake-up), the
service gets the loop through a narrow Protocol of the few methods it uses, never the
whole :class:`~leader.orchestrator.Orchestrator`. The push side of exports is
:class:`silentswarm.leader.exports.ExportService`, which the loop and the jobs service share.
"""
