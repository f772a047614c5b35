// Reading the control loop's records (jobs, ranks, migrations) in one place, so each view
// names a field once: e.g. a migration's source GPU may be flat or nested.

export function jobIdOf(job) {
  return job.job_id ?? job.id;
}

export function ranksOf(job) {
  return job.ranks || job.placement || [];
}

export function migrationId(m) {
  return m.migration_id ?? m.id;
}

export function migrationState(m) {
  return m.state ?? m.status ?? "unknown";
}

export const TERMINAL = new Set(["completed", "failed", "cancelled"]);

export function migrationGpu(m) {
  const src = m.source ?? m.from ?? null;
  if (src && typeof src === "object" && src.node !== undefined) return { node: src.node, gpu: src.gpu };
  if (m.source_node !== undefined) return { node: m.source_node, gpu: m.source_gpu };
  if (m.node !== undefined) return { node: m.node, gpu: m.gpu };
  return null;
}

export function migrationTarget(m) {
  const dst = m.target ?? m.to ?? null;
  if (dst && typeof dst === "object" && dst.node !== undefined) return { node: dst.node, gpu: dst.gpu };
  if (m.target_node !== undefined) return { node: m.target_node, gpu: m.target_gpu };
  return null;
}

export function requestedAt(m) {
  return m.requested_at ?? m.created_at ?? null;
}

export function finishedAt(m) {
  return m.completed_at ?? m.finished_at ?? m.failed_at ?? m.cancelled_at ?? m.ended_at ?? null;
}

// Policy threshold: the one the control loop applied last (the operator's, the alarm
// budget's or the model card's), else the operator's, else the model card's.
export function thresholdOf(policy) {
  if (!policy || policy.error) return null;
  const p = policy.policy || policy;
  return policy.threshold_in_force ?? p.threshold ?? policy.model_threshold ?? null;
}
