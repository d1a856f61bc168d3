//! providerID normalisation, as the in-tree provider does it, so indexes match the same way.

/// The part of a providerID that identifies the machine: Azure scale-set ids are kept whole, every
/// other id is reduced to its last `/`-separated segment (`aws:////i-123` → `i-123`).
pub fn normalize(provider_id: &str) -> &str {
    if provider_id.starts_with("azure://") && provider_id.contains("virtualMachineScaleSets") {
        return provider_id;
    }
    provider_id.rsplit('/').next().unwrap_or(provider_id)
}

#[cfg(test)]
mod tests {
    use super::normalize;

    #[test]
    fn keeps_the_last_segment() {
        assert_eq!(normalize(""), "");
        assert_eq!(normalize("i-12345678"), "i-12345678");
        assert_eq!(normalize("aws:////i-12345678"), "i-12345678");
        assert_eq!(normalize("e2e:///ns/machine-a"), "machine-a");
        assert_eq!(
            normalize(
                "azure:///subscriptions/s/resourceGroups/r/providers/Microsoft.Compute/virtualMachines/cp-1"
            ),
            "cp-1"
        );
    }

    #[test]
    fn keeps_azure_scale_set_ids_whole() {
        let id = "azure:///subscriptions/s/resourceGroups/r/providers/Microsoft.Compute/virtualMachineScaleSets/ss/virtualMachines/0";
        assert_eq!(normalize(id), id);
    }
}
